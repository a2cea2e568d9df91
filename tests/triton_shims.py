"""What the real Triton kernels need to run on a CPU under Triton's interpreter (issue 44), test side only
(tests/test_triton_interpret.py, benchmarks/bench_launches.py --kernels).

    missing()   the packages the tier needs and this environment lacks ([] when it can run)
    install()   set TRITON_INTERPRET=1 and apply the shims below; call it before anything imports triton

The shims (none of them in the package):
    A  autotune   Triton's autotuner times each config through a GPU driver ("0 active drivers"): it takes
                  the first config instead (every config computes the same numbers)
    L  loops      the interpreter leaves a `for` loop's variable a Python int, so a kernel's `i_t.to(tl.int64)`
                  (fla/ops/common/chunk_delta_h.py) fails: its rewrite assigns the variable through
                  `interpreter_semantic.to_tensor` at the top of each loop body, as it does every assignment
    C  cuda       mamba-ssm wraps launches in `torch.cuda.device(x.device.index)` and its norm reads
                  `torch.cuda.get_device_properties(...).multi_processor_count`: a null context and a stub
    I  import     `import mamba_ssm` imports the CUDA extension `selective_scan_cuda`: an empty module
FLA_DISABLE_BACKEND_DISPATCH=1 keeps fla on its plain Triton kernels.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import os
import sys
import types

PACKAGES = {"triton": "triton", "fla": "flash-linear-attention / fla-core", "mamba_ssm": "mamba-ssm"}
SETUP = "bash scripts/setup_triton.sh, then .venv-triton/bin/python -m pytest -m triton_interpret"


def missing() -> list[str]:
    return [name for module, name in PACKAGES.items() if importlib.util.find_spec(module) is None]


def _autotune_first_config() -> None:  # A
    from triton.runtime import autotuner

    autotuner.Autotuner._bench = lambda self, *args, config, **meta: [0.0, 0.0, 0.0]


def _loop_variables_as_tensors() -> None:  # L
    from triton.runtime import interpreter

    class LoopTensors(interpreter.ASTTransformer):
        def visit_For(self, node: ast.For) -> ast.For:
            self.generic_visit(node)
            if isinstance(node.target, ast.Name):
                name = node.target.id
                assign = ast.Assign(targets=[ast.Name(id=name, ctx=ast.Store())],
                                    value=ast.Name(id=name, ctx=ast.Load()))
                node.body.insert(0, self.visit_Assign(assign))
            return node

    interpreter.FunctionRewriter.ast_transformer = LoopTensors()


def _cuda_calls_on_cpu() -> None:  # C
    import torch

    torch.cuda.device = lambda index: contextlib.nullcontext()
    torch.cuda.get_device_properties = lambda device=None: types.SimpleNamespace(
        multi_processor_count=1, name="triton-interpreter", gcnArchName="")


def _no_cuda_extension() -> None:  # I
    sys.modules.setdefault("selective_scan_cuda", types.ModuleType("selective_scan_cuda"))


def install() -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ.setdefault("FLA_DISABLE_BACKEND_DISPATCH", "1")
    _autotune_first_config()
    _loop_variables_as_tensors()
    _cuda_calls_on_cpu()
    _no_cuda_extension()
