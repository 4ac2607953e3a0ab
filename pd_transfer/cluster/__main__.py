"""``python -m pd_transfer.cluster up|serve ...``: the same as ``pd-transfer up|serve ...``."""

import logging
import sys

from pd_transfer.cluster import serve, up

commands = {"up": up.main, "serve": serve.main}
if len(sys.argv) < 2 or sys.argv[1] not in commands:
    print("usage: python -m pd_transfer.cluster up|serve [ARGS]  (see pd-transfer up --help)", file=sys.stderr)
    sys.exit(2)
logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
sys.exit(commands[sys.argv[1]](sys.argv[2:]))
