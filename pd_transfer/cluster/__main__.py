"""``python -m pd_transfer.cluster up|serve ...``: the same as ``pd-transfer up|serve ...``."""

import sys

from pd_transfer.cli import main

if len(sys.argv) < 2 or sys.argv[1] not in ("up", "serve"):
    print("usage: python -m pd_transfer.cluster up|serve [ARGS]  (see pd-transfer up --help)", file=sys.stderr)
    sys.exit(2)
sys.exit(main(sys.argv[1:]))
