import sys

from localllm.cli import main

sys.exit(main())
