import sys

from bsr_lab.cli import main

sys.exit(main())
