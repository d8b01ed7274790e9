"""What the FP8 GEMV kernels compile to on Hopper, on a machine without a GPU: each kernel
(kernels/fp8_gemv.py `w8a16`, kernels/fp8_gemv_w8a8.py `w8a8`) compiled for sm_90a by the
installed Triton, at the tiles given, and its PTX read by the bundled ptxas.

    python -m benchmarks.fp8_gemv_compile [--kernels w8a16,w8a8] [--block-n 32,64,128]
        [--warps 4,8] [--stages 2,3] [--scales block,channel]

Per variant: the MMA instructions (Hopper's warpgroup `wgmma` and their operand types, or
`mma.sync`), conversions to and from e4m3, cp.async copies (present when the loop's loads
are pipelined), registers, spill stores, shared memory, and the SASS's instruction count,
subroutine calls (a correctly rounded division is one) and instructions per K step (the
loop's body). The pointer and size arguments
are declared divisible by 16, as Triton's launcher finds them at run time for this model's
tensors (without that hint nothing is vectorized or pipelined). Not a timing: what a GPU run
would then measure (benchmarks.fp8_gemv).
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import subprocess
import sys
import tempfile
from typing import Any

_DIVISIBLE = ("N", "K", "x_stride", "w_stride", "out_stride", "k_per_split")
_COMMON = {  # argument: type, for both kernels (each adds its own)
    "x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "scale_ptr": "*fp32",
}  # fmt: skip


def _signature(kernel: str) -> dict[str, str]:
    scalars = ["M", "N", "K", "x_stride", "w_stride", "out_stride", "scale_stride", "k_per_split"]
    pointers = {**_COMMON, "bias_ptr": "*bf16", "out_ptr": "*bf16"}
    if kernel == "w8a8":
        pointers = {**_COMMON, "input_scale_ptr": "*fp32", "bias_ptr": "*bf16", "out_ptr": "*bf16"}
    signature = {**pointers, **{name: "i32" for name in scalars}}
    if kernel == "w8a8":
        signature["min_scale"] = "fp32"
    return signature


def _constexprs(kernel: str, block_n: int, blockwise: bool) -> dict[str, Any]:
    tiles = {"BLOCK_M": 16, "BLOCK_N": block_n, "BLOCK_K": 128, "SPLIT_K": 1}
    flags = {"BLOCKWISE": blockwise, "HAS_BIAS": False, "UPCAST_DOT": False}
    if kernel == "w8a8":
        flags.update(STATIC_INPUT=False, FP8_MAX=448.0)
    return {**flags, **tiles}


def _jit_function(kernel: str) -> Any:
    if kernel == "w8a8":
        from kernels.fp8_gemv_w8a8 import _w8a8_gemv_kernel

        return _w8a8_gemv_kernel
    from kernels.fp8_gemv import _gemv_kernel

    return _gemv_kernel


def compile_variant(kernel: str, block_n: int, blockwise: bool, warps: int, stages: int) -> Any:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    constexprs = _constexprs(kernel, block_n, blockwise)
    signature = {**_signature(kernel), **{name: "constexpr" for name in constexprs}}
    attrs = {
        (index,): [["tt.divisibility", 16]]
        for index, name in enumerate(signature)
        if name.endswith("_ptr") or name in _DIVISIBLE
    }
    source = ASTSource(_jit_function(kernel), signature, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": warps, "num_stages": stages, "enable_fp_fusion": kernel != "w8a8"}
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def _ptxas(ptx: str) -> dict[str, Any]:
    """ptxas's registers and spills, and the SASS's instruction count and subroutine calls
    (a correctly rounded division calls one), by nvdisasm."""
    import triton

    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    # The Blackwell ptxas also takes sm_90a and the newest PTX version Triton writes.
    ptxas = next(
        path
        for path in (os.path.join(bin_dir, name) for name in ("ptxas-blackwell", "ptxas"))
        if os.path.exists(path)
    )
    with tempfile.TemporaryDirectory() as folder:
        source, cubin = os.path.join(folder, "k.ptx"), os.path.join(folder, "k.cubin")
        with open(source, "w") as handle:
            handle.write(ptx)
        done = subprocess.run(
            [ptxas, "-v", "--gpu-name", "sm_90a", source, "-o", cubin],
            capture_output=True,
            text=True,
            check=False,
        )
        text = done.stdout + done.stderr
        if done.returncode != 0:
            return {"ptxas_error": text.strip().splitlines()[-1]}
        sass = subprocess.run(
            [os.path.join(bin_dir, "nvdisasm"), "-c", cubin],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    registers = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores", text)
    return {
        "registers": int(registers.group(1)) if registers else None,
        "spill_store_bytes": int(spills.group(1)) if spills else 0,
        "sass_instructions": len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/", sass, re.MULTILINE)),
        "sass_calls": len(re.findall(r"\bCALL\b", sass)),
        "loop_instructions": _loop_instructions(sass),
    }


def _loop_instructions(sass: str) -> int | None:
    """Instructions from the K loop's head to its backward branch (the longest loop: the
    one that runs once per K step), or None without a loop."""
    labels: dict[str, int] = {}
    instructions: list[tuple[int, str]] = []
    for line in sass.splitlines():
        label = re.match(r"^\.?(\.L_x_\d+):", line.strip())
        address = re.match(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*)$", line)
        if label:
            labels[label.group(1)] = len(instructions)
        elif address:
            instructions.append((int(address.group(1), 16), address.group(2)))
    loops = []
    for index, (_, text) in enumerate(instructions):
        target = re.search(r"BRA `?\(?(\.L_x_\d+)", text)
        if target and labels.get(target.group(1), index + 1) <= index:
            loops.append(index + 1 - labels[target.group(1)])
    return max(loops, default=None)


def describe(compiled: Any) -> dict[str, Any]:
    ptx = compiled.asm["ptx"]
    return {
        "wgmma": sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.([\w.]+)", ptx))),
        "mma_sync": len(re.findall(r"\bmma\.sync", ptx)),
        "cvt_e4m3": len(re.findall(r"\bcvt\.[\w.]*e4m3", ptx)),
        "cp_async": len(re.findall(r"\bcp\.async\.(?:ca|cg)", ptx)),
        "shared_bytes": compiled.metadata.shared,
        **_ptxas(ptx),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.fp8_gemv_compile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--kernels", default="w8a16,w8a8")
    p.add_argument("--block-n", default="32,64,128", help="weight rows per program")
    p.add_argument("--warps", default="4,8")
    p.add_argument("--stages", default="3")
    p.add_argument("--scales", default="block,channel")
    args = p.parse_args(argv)

    def ints(text: str) -> list[int]:
        return [int(v) for v in text.split(",") if v]

    grid = itertools.product(
        args.kernels.split(","),
        ints(args.block_n),
        args.scales.split(","),
        ints(args.warps),
        ints(args.stages),
    )
    for kernel, block_n, scales, warps, stages in grid:
        name = f"{kernel} {block_n}x128 {scales} warps={warps} stages={stages}"
        try:
            compiled = compile_variant(kernel, block_n, scales == "block", warps, stages)
            print(name, describe(compiled), flush=True)
        except Exception as error:  # noqa: BLE001 - a tile the compiler refuses is a finding
            print(name, "does not compile:", str(error).strip().splitlines()[-1], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
