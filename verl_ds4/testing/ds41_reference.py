"""The DeepSeek-V4.1 reference harness for tests: :mod:`verl_ds4.models.ds41.reference` (NeMo Automodel
0.7.0 driven in fp64, the tiny V4.1 config, the local tokenizer, the builders) and its weight maps."""

from verl_ds4.models.ds41.reference import *  # noqa: F401,F403
from verl_ds4.models.ds41.reference import LOCAL_COMPRESSED_VOCAB, _randomise  # noqa: F401
from verl_ds4.models.ds41.reference_weights import *  # noqa: F401,F403
