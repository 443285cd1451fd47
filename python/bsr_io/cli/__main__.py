import sys

from bsr_io.cli import main

sys.exit(main())
