"""V4.1 single-pass mHC (``verl_ds4.models.ds41.hyper_connection``) against NeMo Automodel 0.7.0 at fp64.

One site's coefficients, and a chain of sites wired as the reference's decoder wires them (initial
carried ``pre`` on stream 0, each sub-layer collapsed with the previous site's ``pre``, a final collapse
with the last one, no ``hc_head``), with the same weights: <= 1e-10 relative. Negative control: V4's
schedule (each site collapses with its own ``pre``) on the same weights is far off.
"""

from __future__ import annotations

import pytest
import torch

from verl_ds4.models.ds41.hyper_connection import DS41HyperConnection, collapse, initial_carried_pre
from verl_ds4.testing import ds41_reference as ref

pytestmark = pytest.mark.skipif(ref.reference_missing() is not None, reason=str(ref.reference_missing()))

TEXT = ref.tiny_text_config(hc_mult=4, hc_sinkhorn_iters=20)
N, H = TEXT["hc_mult"], TEXT["hidden_size"]


def rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


def site_pair(seed: int):
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41TextConfig
    from nemo_automodel.components.models.deepseek_v41.layers import DeepseekV41HyperConnection

    theirs = DeepseekV41HyperConnection(DeepseekV41TextConfig(**TEXT)).double()
    g = torch.Generator().manual_seed(seed)
    ours = DS41HyperConnection(H, N, TEXT["hc_sinkhorn_iters"], TEXT["hc_eps"], TEXT["rms_norm_eps"], dtype=torch.float64)
    with torch.no_grad():
        theirs.fn.copy_(0.3 * torch.randn(theirs.fn.shape, generator=g, dtype=torch.float64))
        theirs.base.copy_(0.5 * torch.randn(theirs.base.shape, generator=g, dtype=torch.float64))
        theirs.scale.copy_(1 + 0.3 * torch.randn(3, generator=g, dtype=torch.float64))
        ours.mapping_proj.weight.copy_(theirs.fn)
        ours.bias.copy_(theirs.base)
        ours.alpha_pre.fill_(theirs.scale[0])
        ours.alpha_post.fill_(theirs.scale[1])
        ours.alpha_res.fill_(theirs.scale[2])
    return ours, theirs


def streams(seed=0, shape=(2, 7)):
    return torch.randn(*shape, N, H, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def test_site_coefficients_equal_the_reference():
    ours, theirs = site_pair(1)
    x = streams()
    with ref.fp64_reference():
        mix = theirs(x)
    pre, post, res = ours.mixing(x)
    errors = [rel(pre, mix.pre), rel(post, mix.post), rel(res, mix.comb)]
    print("mHC site pre/post/comb fp64 relative differences:", [f"{e:.1e}" for e in errors])
    assert max(errors) <= 1e-10 and mix.pre.dtype == torch.float64


def run_chain(sites, x, sublayers, schedule):
    """The reference's block loop with our sites (``schedule`` 'v41') or V4's (``'v4'``)."""
    carried = initial_carried_pre(x.shape[:-2], N, dtype=x.dtype)
    for site, f in zip(sites, sublayers):
        if schedule == "v41":
            x, carried = site(x, carried, f)
        else:
            x = super(DS41HyperConnection, site).forward(x, f)
            carried = site.mixing(x)[0]
    return collapse(x, carried)


def test_chain_of_sites_equals_the_reference_decoder_wiring():
    from nemo_automodel.components.models.deepseek_v41.layers import DeepseekV41HyperConnection as Ref

    pairs = [site_pair(10 + k) for k in range(4)]
    g = torch.Generator().manual_seed(5)
    weights = [0.4 * torch.randn(H, H, generator=g, dtype=torch.float64) for _ in pairs]
    sublayers = [lambda y, w=w: torch.tanh(y @ w) for w in weights]
    x = streams(3)
    with ref.fp64_reference():  # the reference's DeepseekV41Model.forward loop, one sub-layer per site
        h = x
        carried = torch.zeros(*x.shape[:-2], N, dtype=torch.float64)
        carried[..., 0] = 1
        for (_, theirs), f in zip(pairs, sublayers):
            mix = theirs(h)
            h = Ref.expand(f(Ref.collapse(h, carried)), h, mix)
            carried = mix.pre
        expected = Ref.collapse(h, carried)
    got = run_chain([o for o, _ in pairs], x, sublayers, "v41")
    err = rel(got, expected)
    print(f"single-pass mHC chain (4 sites) fp64 relative difference: {err:.1e}")
    assert err <= 1e-10
    v4 = run_chain([o for o, _ in pairs], x, sublayers, "v4")
    print(f"V4's schedule on the same weights: {rel(v4, expected):.1e}")
    assert rel(v4, expected) > 1e-3  # negative control


def test_wrong_carried_shape_is_refused():
    ours, _ = site_pair(0)
    with pytest.raises(ValueError, match="carried pre"):
        ours(streams(), torch.ones(2, 7, N - 1, dtype=torch.float64), lambda y: y)
