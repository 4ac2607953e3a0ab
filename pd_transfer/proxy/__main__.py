import sys

from pd_transfer.proxy.cli import main

sys.exit(main())
