"""``python -m trainer.torchft``: a torchft job on this host (trainer/torchft/supervisor.py)."""

import sys

from trainer.torchft.supervisor import main

sys.exit(main())
