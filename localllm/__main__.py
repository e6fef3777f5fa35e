import sys

from localllm.cli.main import main

sys.exit(main())
