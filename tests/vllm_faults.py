"""A worker extension that fails on demand, for tests/vllm_arch_worker.py (imported inside the vLLM worker).

While the file named by ``FAIRCAST_TEST_FAULT`` exists, the next ``faircast_push`` reads it, removes it, reloads
the first half of the pushed tensors (a half-written update) and then: ``raise`` raises, ``slow`` writes the
whole push 3 s later, ``hang`` sleeps 15 s, ``die`` waits to be killed (it writes its pid to ``<file>.pid`` first,
for the test to kill it).
"""
import os
import time

from vllm_receiver import compat
from vllm_receiver.extension import FairCastWorkerExtension


class FaultyExtension(FairCastWorkerExtension):
    def faircast_push(self, buffer, specs, repack_head, expect):
        path = os.environ.get("FAIRCAST_TEST_FAULT", "")
        if not path or not os.path.exists(path):
            return super().faircast_push(buffer, specs, repack_head, expect)
        with open(path) as f:
            fault = f.read().strip()
        os.unlink(path)
        buf = self._faircast_buffer(buffer)
        if fault == "inside":
            def half_then_fail():
                for k, s in enumerate(specs):
                    yield s[0], buf.view(s)
                    if k >= len(specs) // 2 and s[0].endswith(("q_proj.weight", "gate_proj.weight")):
                        break
                raise RuntimeError("planted failure inside the reload")
            compat.reload(self, half_then_fail())
        compat.reload(self, [(s[0], buf.view(s)) for s in specs[: max(1, len(specs) // 2)]])
        with open(path + ".pid", "w") as f:
            f.write(str(os.getpid()))
        if fault == "raise":
            raise RuntimeError("planted failure after half the layers")
        if fault == "slow":  # then the rest: the whole push lands, 3 s late
            time.sleep(3)
            return super().faircast_push(buffer, specs, repack_head, None)
        time.sleep(15 if fault == "hang" else 600)
        return {"version": self.faircast_version()}
