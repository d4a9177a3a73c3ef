"""Exit with the status of a finished Ray job's entrypoint (used by scripts/ray_cluster.sh submit).

    python scripts/ray_job_exit.py --address http://10.0.0.1:8265 --job-id ds4-ppo-123

`ray job submit` exits 1 for any job that failed, whatever the trainer returned. This reads the
job's record from the job API (waiting up to --timeout seconds for it to reach a terminal state)
and exits with the entrypoint's own exit code: 0 for a job that succeeded, the trainer's status
for one that failed (2 for a launcher's refusal, for example), and 1 with a message saying why
when the record cannot be read or holds no exit code (a stopped job, a driver that was killed).
"""

from __future__ import annotations

import argparse
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--address", required=True, help="the job API address (http://HEAD_IP:DASHBOARD_PORT)")
    parser.add_argument("--job-id", required=True, help="the submission id of the job")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for a terminal state (default 60)")
    args = parser.parse_args(argv)

    from ray.job_submission import JobStatus, JobSubmissionClient

    deadline = time.monotonic() + args.timeout
    last_error: Exception | None = None
    info = None
    while time.monotonic() < deadline:
        try:
            info = JobSubmissionClient(args.address).get_job_info(args.job_id)
            last_error = None
            if info.status.is_terminal():
                break
        except Exception as err:  # the dashboard busy or restarting: retry until the deadline
            last_error = err
        time.sleep(2.0)
    if info is None or last_error is not None:
        print(f"ray job {args.job_id}: its record could not be read at {args.address} "
              f"({type(last_error).__name__ if last_error else 'no record'}: {last_error}); exit status unknown",
              file=sys.stderr)
        return 1
    if not info.status.is_terminal():
        print(f"ray job {args.job_id}: still {info.status} after {args.timeout:.0f} s; exit status unknown",
              file=sys.stderr)
        return 1
    if info.status == JobStatus.SUCCEEDED:
        return 0
    code = info.driver_exit_code
    print(f"ray job {args.job_id}: {info.status}, entrypoint exit code {code if code is not None else 'unknown'}"
          f" ({(info.message or '').splitlines()[0][:200] if info.message else 'no message'})", file=sys.stderr)
    return code if isinstance(code, int) and code > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
