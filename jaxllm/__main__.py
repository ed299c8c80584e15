import sys

from jaxllm.cli import main

sys.exit(main())
