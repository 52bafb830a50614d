"""Static checks of the sm_90a kernels' machine code, on a machine without a GPU (nvcc, and cuobjdump + nvdisasm on
the PATH or in $CUDA_BIN; PyPI's nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm wheels hold them).

    python3 tools/sass_check.py compile cuda/kernels/sm90/flash_sm90_hdim128.cu /tmp/new.o   # + /tmp/new.o.log
    python3 tools/sass_check.py compare /tmp/base.o /tmp/new.o [--filter REGEX] [--rename OLD=NEW ...]
    python3 tools/sass_check.py spills /tmp/base.o.log /tmp/new.o.log
    python3 tools/sass_check.py descs /tmp/new.o [more.o ...]
    python3 tools/sass_check.py waits /tmp/new.o REGEX

compile: one translation unit with the project's CUDA flags (CMakeLists.txt) and ptxas -v, the log beside the object.
compare: per kernel (demangled), instruction and LDG counts of two objects and whether the code is the same (branch
targets ignored): a change meant for some kernels leaves the others identical, which needs no GPU to confirm;
--rename (a regex and its replacement, repeatable) maps the second object's demangled names to the first's where a
template argument changed type.
spills: per kernel, registers and spill bytes from two compile logs, the kernels that differ marked.
descs: every uniform register an instruction reads inside a memory operand (an address addend, a load's memory
descriptor desc[UR]) must be written somewhere in its kernel; a register that never is means ptxas lost its
definition (CUDA 13.0's ptxas did so for the d64 paged cp.async wgmma decode kernels' copies with an L2 cache hint:
an illegal instruction at run time, NOTES session 72). Exit status 3 if any kernel has one (1: the tool failed).
waits: for each kernel matching REGEX, the wgmma issues and waits in order with the MUFU operations (EX2, TANH)
between them: where the assembler placed a softmax against the products it is meant to overlap (NOTES, session 40).
"""
import argparse
import collections
import os
import re
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cuda_flags():
    """nvcc's flags for an sm_90a translation unit: CMakeLists.txt's `_cuda_flags` (one source for them), with the
    standard, optimisation and architecture CMake adds, and ptxas -v for the registers and spills."""
    text = open(os.path.join(ROOT, "CMakeLists.txt")).read()
    flags = re.search(r"set\(_cuda_flags ([^)]*)\)", text).group(1).split()
    return ["-std=c++17", "-O3", *flags, "-Xptxas=-v", "-gencode=arch=compute_90a,code=sm_90a"]


def _tool(name):
    path = os.path.join(os.environ["CUDA_BIN"], name) if "CUDA_BIN" in os.environ else shutil.which(name)
    if not path or not os.path.exists(path):
        sys.exit(f"sass_check: {name} not found (put it on the PATH or set CUDA_BIN)")
    return path


def _demangle(names):
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True).stdout
    short = []
    for name in out.split("\n")[:len(names)]:
        name = name.replace("jax_flash::cuda::sm90::", "").replace("jax_flash::cuda::", "").replace("jax_flash::", "")
        short.append(re.sub(r"\(FlashParams.*", "", name))
    return short


def sass(obj):
    """{demangled kernel: [instructions]} of an object file (or a library's fatbinary). Where it holds code for more
    than one architecture (a wheel built for sm_80 and sm_90a), each kernel appears once per architecture, its name
    followed by " [sm_XX]"."""
    env = dict(os.environ, PATH=os.path.dirname(_tool("nvdisasm")) + os.pathsep + os.environ.get("PATH", ""))
    text = subprocess.run([_tool("cuobjdump"), "-sass", obj], capture_output=True, text=True, check=True,
                          env=env).stdout
    funcs, current, arch = {}, None, ""
    for line in text.split("\n"):
        m = re.match(r"arch = (\S+)", line)
        if m:
            arch = m.group(1)
            continue
        m = re.match(r"\s+Function : (\S+)", line)
        if m:
            current = (m.group(1), arch)
            funcs[current] = []
            continue
        m = re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(.*?);", line)
        if m and current:
            funcs[current].append(re.sub(r"\s+", " ", m.group(1)).strip())
    names = _demangle([name for name, _ in funcs])
    several = len({a for _, a in funcs}) > 1
    return {f"{name} [{a}]" if several else name: ins for name, (_, a), ins in zip(names, funcs, funcs.values())}


def _opcode(ins):
    words = ins.split()
    return words[1] if words[0].startswith("@") else words[0]


def compile_tu(args):
    log = args.out + ".log"
    cmd = ["nvcc", *cuda_flags(), "-I" + os.path.join(ROOT, "cuda"), "-c", args.source, "-o", args.out]
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
    print(f"{' '.join(cmd)}\n-> rc {rc}, log {log}")
    return rc


def compare(args):
    a, b = sass(args.a), sass(args.b)
    for rule in args.rename or []:  # the second object's names as the first's (a template argument's type changed)
        if "=" not in rule:
            sys.exit(f"--rename takes OLD=NEW (a regex and its replacement), got {rule!r}")
        old, new = rule.split("=", 1)
        renamed = {re.sub(old, new, name): ins for name, ins in b.items()}
        if len(renamed) < len(b):
            sys.exit(f"--rename {rule!r} maps two kernels of {args.b} to one name")
        b = renamed
    same = 0
    for name in sorted(set(a) | set(b)):
        if args.filter and not re.search(args.filter, name):
            continue
        x, y = a.get(name, []), b.get(name, [])
        norm = lambda ins: [re.sub(r"0x[0-9a-f]+", "X", i) for i in ins]  # noqa: E731
        if norm(x) == norm(y):
            same += 1
            continue
        ldg = lambda ins: sum("LDG" in i for i in ins)  # noqa: E731
        print(f"{len(x):7d} {len(y):7d} {len(y) - len(x):+6d}  LDG {ldg(x):4d} -> {ldg(y):4d}  {name[:150]}")
    print(f"{same} kernels identical")


def _ptxas_log(path):
    out, fn = {}, None
    for line in open(path):
        m = re.search(r"Compiling entry function '(\S+)'", line) or re.search(r"Function properties for (\S+)", line)
        if m:
            fn = m.group(1)
            continue
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and fn:
            out.setdefault(fn, {})["spill"] = f"{m.group(1)}/{m.group(2)}"
        m = re.search(r"Used (\d+) registers", line)
        if m and fn:
            out.setdefault(fn, {})["regs"] = m.group(1)
    return out


def spills(args):
    a, b = _ptxas_log(args.a), _ptxas_log(args.b)
    names = sorted(set(a) | set(b))
    for mangled, name in zip(names, _demangle(names)):
        if "kernel" not in name:
            continue
        x, y = a.get(mangled, {}), b.get(mangled, {})
        mark = "  *" if x != y else ""
        print(f"{x.get('regs', '-'):>4} {x.get('spill', '-'):>9} | {y.get('regs', '-'):>4} {y.get('spill', '-'):>9}"
              f"{mark} {name[:150]}")


# Opcodes (or their prefixes) whose first operand, when a uniform register, is written: the uniform datapath's own
# (U...), the moves into it, warp votes and reductions into a uniform register. (Other first operands, e.g. BRA.DIV's,
# are read.) ELECT writes its second operand.
_UNIFORM_WRITERS = ("U", "S2UR", "R2UR", "LDCU", "VOTEU", "REDUX")


def _uniform_writes(ins):
    """Uniform registers an instruction writes (two for 64-bit and wide forms)."""
    words = ins.split(None, 1)
    if words[0].startswith("@"):
        words = words[1].split(None, 1) if len(words) > 1 else []
    if len(words) < 2:
        return []
    opcode, operands = words[0], [x.strip() for x in words[1].split(",")]
    if opcode.startswith("ELECT"):
        target = operands[1] if len(operands) > 1 else ""
    elif opcode.startswith(_UNIFORM_WRITERS):
        target = operands[0]
    else:
        return []
    m = re.fullmatch(r"UR(\d+)", target)
    if not m:
        return []
    n = int(m.group(1))
    return [n, n + 1] if re.search(r"\.(64|WIDE)\b", opcode) else [n]


def _uniform_memory_reads(ins):
    """Uniform registers an instruction reads inside its memory operands: address addends, and both halves of a
    memory descriptor desc[URn]."""
    read = {int(n) for mem in re.findall(r"\[([^\]]*)\]", ins) for n in re.findall(r"\bUR(\d+)\b", mem)}
    read |= {int(n) + 1 for n in re.findall(r"desc\[UR(\d+)\]", ins)}
    return read


def descs(args):
    total = 0
    for obj in args.objs:
        kernels, bad = sass(obj), 0
        for name, ins in kernels.items():
            written = {n for x in ins for n in _uniform_writes(x)}
            missing = sorted({n for x in ins for n in _uniform_memory_reads(x)} - written)
            if missing:
                bad += 1
                print(f"never written: {', '.join(f'UR{n}' for n in missing)}  {name[:150]}")
        print(f"{obj}: {len(kernels)} kernels, {bad} with a memory operand's uniform register never written")
        total += bad
    return 3 if total else 0


def waits(args):
    for name, ins in sass(args.obj).items():
        if not re.search(args.regex, name):
            continue
        print(name[:160], len(ins))
        prev = 0
        for i, x in enumerate(ins):
            if "WARPGROUP.DEPBAR" in x or ("HGMMA" in x and "gsb0" in x):
                ops = collections.Counter(_opcode(y) for y in ins[prev:i])
                print(f"  {i:6d} {x[:48]:48s} EX2 {ops['MUFU.EX2']:3d}  TANH {ops['MUFU.TANH']:3d}  "
                      f"({i - prev} instructions before)")
                prev = i + 1


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    extra = {"objs": {"nargs": "+"}, "--rename": {"action": "append"}}  # the parameters that are not one value
    for name, fn, params in (("compile", compile_tu, ("source", "out")),
                             ("compare", compare, ("a", "b", "--filter", "--rename")),
                             ("spills", spills, ("a", "b")), ("descs", descs, ("objs",)),
                             ("waits", waits, ("obj", "regex"))):
        p = sub.add_parser(name)
        for param in params:
            p.add_argument(param, **extra.get(param, {}))
        p.set_defaults(fn=fn)
    args = parser.parse_args()
    sys.exit(args.fn(args) or 0)


if __name__ == "__main__":
    main()
