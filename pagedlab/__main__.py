import sys

from pagedlab.cli import main

sys.exit(main())
