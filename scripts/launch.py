"""torchrun with the app's exit codes: `python scripts/launch.py [torchrun options] train.py [overrides]`.

Takes torchrun's own options and runs torchrun's launcher in this process. A worker that stops on a user mistake
prints one `error: ...` line and exits 2 (train.py), but torchrun itself always exits 1 and ends with its failure
report (a launcher traceback and a ~20-line summary), so the line is buried. Here, when the failed workers left such
a line (train.py writes it to the reply file torchrun names in TORCHELASTIC_ERROR_FILE), the report is left out, the
line is printed last and the exit code is 2. Any other failure (a crash, a signal) keeps torchrun's report and exit 1.
`make train` launches through it.
"""

from __future__ import annotations

import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run

USER_ERROR_EXIT = 2  # train.py's exit code for a mistake the user can fix (a setting, a file, a diverged run)


def user_error_lines(failure: ChildFailedError) -> list[str]:
    """The distinct one-line errors of the workers that exited with USER_ERROR_EXIT, root cause first."""
    root, _ = failure.get_first_failure()
    ranks = sorted(failure.failures, key=lambda r: (r != root, r))
    lines: list[str] = []
    for rank in ranks:
        f = failure.failures[rank]
        if f.exitcode == USER_ERROR_EXIT and isinstance(f.message, str) and f.message.startswith("error: "):
            if f.message not in lines:
                lines.append(f.message)
    return lines


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        run(args)
    except ChildFailedError as e:
        lines = user_error_lines(e)
        if not lines:
            print(e.format_msg(), file=sys.stderr)
            return 1
        sys.stdout.flush()
        print("\n".join(lines), file=sys.stderr, flush=True)
        return USER_ERROR_EXIT
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
