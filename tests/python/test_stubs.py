"""The type stubs (ferry/_ferry.pyi, with py.typed) list every public name of the extension and of
its classes, so that they cannot fall behind the bindings unnoticed; and they are valid Python."""

import ast
import pathlib

import ferry
from ferry import _ferry

PACKAGE = pathlib.Path(ferry.__file__).resolve().parent
STUB = PACKAGE / "_ferry.pyi"


def public(names):
    return {n for n in names if not n.startswith("_") or n == "__version__"}


def stub_tree():
    return ast.parse(STUB.read_text(), filename=str(STUB))


def top_level(tree):
    names = {}
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            names[node.name] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    names[target.id] = node
    return names


def class_members(node):
    out = set()
    for item in node.body:
        if isinstance(item, ast.FunctionDef):
            out.add(item.name)
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            out.add(item.target.id)
    return out


def test_the_stubs_ship_with_the_package():
    assert STUB.is_file()
    assert (PACKAGE / "py.typed").is_file()


def test_every_public_name_of_the_module_is_stubbed():
    names = top_level(stub_tree())
    missing = public(dir(_ferry)) - set(names)
    assert not missing, f"not in {STUB.name}: {sorted(missing)}"
    extra = public(names) - set(dir(_ferry)) - {"__all__"}
    assert not extra, f"in {STUB.name} but not in the module: {sorted(extra)}"


def test_every_public_member_of_each_class_is_stubbed():
    names = top_level(stub_tree())
    for name in public(dir(_ferry)):
        obj = getattr(_ferry, name)
        if not isinstance(obj, type) or not isinstance(names[name], ast.ClassDef):
            continue  # LlamaConfig is an alias of ModelConfig
        base = Exception if issubclass(obj, Exception) else object
        members = {m for m in vars(obj) if not m.startswith("_") and m not in vars(base)}
        if issubclass(obj, Exception):
            members |= {"code", "message"}  # set on every instance
        missing = members - class_members(names[name])
        assert not missing, f"{name}: not in {STUB.name}: {sorted(missing)}"
