"""One process of the two-process tensor-parallel test (tests/test_tensor_parallel.py::test_two_processes): joins
`jax.distributed` on 127.0.0.1, loads the target and head of DIR onto a 2 x 4 mesh over both processes' devices
(rows split between the processes, weights within each), generates greedily and prints the tokens as JSON.

    python tp_distributed.py PROCESS_ID PORT DIR PROMPTS_JSON NEW K
"""
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

jax.config.update("jax_default_matmul_precision", "highest")


def main(pid: int, port: int, root: Path, prompts, new: int, k: int):
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid,
                               local_device_ids=list(range(4)))
    import pjax
    mesh = pjax.make_mesh(2, 4)
    target = pjax.load_target(root / "target", jnp.float32, mesh=mesh)
    head = pjax.load_drafter(root / "head", jnp.float32, target=target, mesh=mesh)
    res = pjax.generate(target, head, prompts, max_new_tokens=new, num_speculative_tokens=k, mesh=mesh,
                        compiler_options={"xla_backend_optimization_level": 0})
    print(json.dumps(res.tokens), flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    a = sys.argv[1:]
    main(int(a[0]), int(a[1]), Path(a[2]), json.loads(a[3]), int(a[4]), int(a[5]))
