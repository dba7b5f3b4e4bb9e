"""Reading StableHLO programs: @main's signature, and a program specialized to static shapes.

There are two readers, on purpose:

- `parse_main_signature` reads @main's parameter and result types and its aliasing attributes
  from the text with no JAX. `loading.load_artifact` checks every body against its program
  with it, so an artifact is validated (by the repository writer, by tests) without importing
  JAX or compiling anything. `strip_aliasing` writes the copying control of a body.
- `read_signature` and `specialize` use MLIR's own parser, through JAX's bindings (imported
  when called): a generic program may have dynamic dimensions (`tensor<?x4xf32>`), and
  serving it means rewriting it at static shapes and running StableHLO's shape refinement, the
  pass JAX runs before compiling an exported function. No text reader could do that.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_MAIN_RE = re.compile(r"func\.func\s+(?:public\s+)?@main\s*\(")


def _split_top_level(text: str, sep: str = ",") -> list[str]:
    """Split on `sep` outside (), <>, {}, [] and string literals."""
    parts, depth, cur, in_str, i = [], 0, [], False, 0
    while i < len(text):
        c = text[i]
        if in_str:
            cur.append(c)
            if c == "\\" and i + 1 < len(text):
                cur.append(text[i + 1])
                i += 1
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
            cur.append(c)
        elif c in "(<{[":
            depth += 1
            cur.append(c)
        elif c in ")>}]":
            depth -= 1
            cur.append(c)
        elif c == sep and depth == 0:
            parts.append("".join(cur).strip())
            cur = []
        else:
            cur.append(c)
        i += 1
    if "".join(cur).strip():
        parts.append("".join(cur).strip())
    return parts


def _matching(text: str, start: int, open_c: str, close_c: str) -> int:
    """Index of the bracket closing the one at `start` (strings skipped)."""
    depth, in_str, i = 0, False, start
    while i < len(text):
        c = text[i]
        if in_str:
            if c == "\\":
                i += 1
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
        elif c == open_c:
            depth += 1
        elif c == close_c:
            depth -= 1
            if depth == 0:
                return i
        i += 1
    raise ValueError(f"unbalanced {open_c}{close_c}")


_TENSOR_RE = re.compile(r"tensor<([^>]*)>")
_ALIAS_RE = re.compile(r"tf\.aliasing_output\s*=\s*(\d+)")


@dataclass(frozen=True)
class MainSignature:
    inputs: tuple[str, ...]  # tensor types, e.g. "tensor<1x1xi32>"
    outputs: tuple[str, ...]
    aliases: tuple[tuple[int, int], ...]  # (output index, input index) from tf.aliasing_output


def parse_main_signature(text: str) -> MainSignature:
    """Read @main's parameter and result types and its aliasing attributes from StableHLO text."""
    m = _MAIN_RE.search(text)
    if not m:
        raise ValueError("no func.func @main")
    open_at = m.end() - 1
    close_at = _matching(text, open_at, "(", ")")
    params = _split_top_level(text[open_at + 1:close_at])
    inputs, aliases = [], []
    for idx, p in enumerate(params):
        t = _TENSOR_RE.search(p)
        if not t:
            raise ValueError(f"parameter {idx} of @main is not a tensor: {p[:80]}")
        inputs.append(f"tensor<{t.group(1)}>")
        a = _ALIAS_RE.search(p)
        if a:
            aliases.append((int(a.group(1)), idx))
    rest = text[close_at + 1:].lstrip()
    if not rest.startswith("->"):
        raise ValueError("@main has no results")
    rest = rest[2:].lstrip()
    if rest.startswith("("):
        end = _matching(rest, 0, "(", ")")
        results = _split_top_level(rest[1:end])
    else:
        results = [rest.split("{", 1)[0]]
    outputs = []
    for r in results:
        t = _TENSOR_RE.search(r)
        if not t:
            raise ValueError(f"a result of @main is not a tensor: {r[:80]}")
        outputs.append(f"tensor<{t.group(1)}>")
    return MainSignature(tuple(inputs), tuple(outputs), tuple(sorted(aliases)))


def num_partitions(text: str) -> int:
    """The devices a body's module is lowered for (mhlo.num_partitions; 1 when absent)."""
    m = re.search(r"mhlo\.num_partitions\s*=\s*(\d+)", text[:text.find("func.func")])
    return int(m.group(1)) if m else 1


def strip_aliasing(text: str) -> str:
    """The same body without its tf.aliasing_output attributes: the pools are then copied, not
    updated in place (the donate_kv_pools=false control)."""
    text = re.sub(r",\s*tf\.aliasing_output\s*=\s*\d+\s*:\s*i32", "", text)
    return re.sub(r"tf\.aliasing_output\s*=\s*\d+\s*:\s*i32\s*,?\s*", "", text)


# ------------------------------------------------------------------ through MLIR

class ProgramError(ValueError):
    """A program, binding or request refused; the message names the problem."""


@dataclass(frozen=True)
class TensorType:
    dtype: str  # StableHLO element type
    dims: tuple  # ints; None for a dynamic dimension

    @property
    def static(self) -> bool:
        return all(d is not None for d in self.dims)

    def text(self) -> str:
        return "tensor<" + "".join(f"{'?' if d is None else d}x" for d in self.dims) \
            + self.dtype + ">"

    def __str__(self) -> str:
        return f"{self.dtype}[{', '.join('?' if d is None else str(d) for d in self.dims)}]"


@dataclass(frozen=True)
class Signature:
    inputs: list
    results: list


def _ir():
    from jax._src.interpreters import mlir as jax_mlir
    from jax._src.lib.mlir import ir
    return jax_mlir, ir


def _main_op(module, ir):
    for op in module.body.operations:
        if "sym_name" in op.attributes and ir.StringAttr(op.attributes["sym_name"]).value == "main":
            return op
    raise ProgramError("the program has no @main function")


def _tensor_type(t, ir) -> TensorType:
    rt = ir.RankedTensorType(t)
    return TensorType(str(rt.element_type),
                      tuple(None if rt.is_dynamic_dim(i) else rt.shape[i] for i in range(rt.rank)))


def read_signature(text: str) -> Signature:
    """@main's argument and result types."""
    jax_mlir, ir = _ir()
    with jax_mlir.make_ir_context():
        try:
            module = ir.Module.parse(text)
        except Exception as e:
            raise ProgramError(f"the program is not StableHLO text MLIR can parse: "
                               f"{str(e).splitlines()[0]}") from None
        ftype = ir.FunctionType(ir.TypeAttr(_main_op(module, ir).attributes["function_type"]).value)
        return Signature([_tensor_type(t, ir) for t in ftype.inputs],
                         [_tensor_type(t, ir) for t in ftype.results])


def specialize(text: str, shapes: list[tuple[int, ...]], aliases: dict[int, int]) -> str:
    """The program at static argument shapes `shapes`, with argument i donated to result
    aliases[i]: the program becomes a private function called from a new @main of those types,
    and StableHLO's shape refinement makes every shape in it static (and checks the program's
    own shape assertions, so inputs of inconsistent shapes are refused here)."""
    jax_mlir, ir = _ir()
    with jax_mlir.make_ir_context():
        module = ir.Module.parse(text)
        main = _main_op(module, ir)
        ftype = ir.FunctionType(ir.TypeAttr(main.attributes["function_type"]).value)
        inputs = [_tensor_type(t, ir) for t in ftype.inputs]
        results = [str(t) for t in ftype.results]
        main.attributes["sym_name"] = ir.StringAttr.get("_tlaloc_program")
        main.attributes["sym_visibility"] = ir.StringAttr.get("private")
        for key in ("arg_attrs", "res_attrs"):  # aliases are set on the new @main only
            if key in main.attributes:
                del main.attributes[key]
        static = [TensorType(t.dtype, tuple(s)).text() for t, s in zip(inputs, shapes)]
        params = ", ".join(f"%a{i}: {t}" + (f" {{tf.aliasing_output = {aliases[i]} : i32}}"
                                              if i in aliases else "")
                           for i, t in enumerate(static))
        lines = [f"  func.func public @main({params}) -> ({', '.join(results)}) {{"]
        lines += [f"    %c{i} = stablehlo.convert %a{i} : ({s}) -> {t.text()}"
                  for i, (s, t) in enumerate(zip(static, inputs))]
        call = (f"func.call @_tlaloc_program({', '.join(f'%c{i}' for i in range(len(inputs)))})"
                f" : ({', '.join(t.text() for t in inputs)}) -> ({', '.join(results)})")
        if results:
            lines.append(f"    %r:{len(results)} = {call}")
            lines.append(f"    return {', '.join(f'%r#{i}' for i in range(len(results)))} : "
                         f"{', '.join(results)}")
        else:
            lines += [f"    {call}", "    return"]
        lines.append("  }")
        body = module.operation.get_asm(enable_debug_info=False).rstrip()
        assert body.endswith("}")
        wrapped = ir.Module.parse(body[:-1] + "\n".join(lines) + "\n}\n")
        try:
            refined = jax_mlir.refine_polymorphic_shapes(wrapped)
        except Exception as e:
            raise ProgramError(_first_line(e)) from None
        return refined.operation.get_asm(enable_debug_info=False)


def _first_line(e: Exception) -> str:
    msg = str(e)
    found = re.search(r"(Input shapes do not match[^.]*\.[^.]*\.)", msg)
    return found.group(1) if found else msg.strip().splitlines()[0][:400]
