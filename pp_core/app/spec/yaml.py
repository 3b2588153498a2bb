"""Reading a pipeline file's YAML safely: plain data only, and nothing a file can blow up.

``yaml.safe_load`` builds plain data, but it still accepts a key written twice in one mapping
(the last silently wins), aliases that expand a few hundred bytes into gigabytes ("billion
laughs"), nesting deep enough to exhaust Python's stack, and bytes that are not UTF-8. Each of
these is refused here with one line naming the problem (and the key and line where there is one).
"""

from __future__ import annotations

import yaml

from pp_core.errors import quoted, shorten

__all__ = ["read_yaml", "load_yaml_text", "YamlProblem", "MAX_NODES", "MAX_DEPTH"]

MAX_NODES = 100_000  # a pipeline file has a few dozen; aliases may not expand beyond this
MAX_DEPTH = 64  # nesting of mappings and lists


class YamlProblem(ValueError):
    """The text is not a pipeline file pp-core will read; the message is one line."""


def _check_keys(node) -> None:
    """Refuse a key given twice in one mapping (YAML's last-wins would hide the first)."""
    seen: dict = {}
    for key_node, _ in node.value:
        if not isinstance(key_node, yaml.ScalarNode) or key_node.tag.endswith(":merge"):
            continue
        key, line = (key_node.tag, key_node.value), key_node.start_mark.line + 1
        if key in seen:
            raise YamlProblem(f"line {line}: key {quoted(key_node.value)} is given twice in one "
                              f"mapping (first on line {seen[key]}); keep one")
        seen[key] = line


def _check_size(root) -> None:
    """Refuse a document whose aliases expand beyond MAX_NODES nodes or nest beyond MAX_DEPTH,
    or that gives a key twice in one mapping.

    Walks the composed node graph (aliases share nodes, so composing is cheap) counting each
    shared node once per use, with the expanded size of every node memoised: linear in the
    file, whatever the aliases multiply to.
    """
    sizes: dict[int, int] = {}
    stack = [(root, 1, False)]
    while stack:
        node, depth, done = stack.pop()
        if depth > MAX_DEPTH:
            raise YamlProblem(f"line {node.start_mark.line + 1}: nested more than {MAX_DEPTH} "
                              f"levels deep; a pipeline file needs a handful")
        children = [] if isinstance(node, yaml.ScalarNode) else \
            [c for pair in node.value for c in pair] if isinstance(node, yaml.MappingNode) \
            else list(node.value)
        if done:
            sizes[id(node)] = 1 + sum(sizes[id(c)] for c in children)
            if sizes[id(node)] > MAX_NODES:
                raise YamlProblem(f"line {node.start_mark.line + 1}: the aliases (*name) here "
                                  f"expand to more than {MAX_NODES:,} values; a pipeline file "
                                  f"needs a few dozen")
        elif id(node) not in sizes:
            if isinstance(node, yaml.MappingNode):
                _check_keys(node)
            stack.append((node, depth, True))
            stack.extend((c, depth + 1, False) for c in children if id(c) not in sizes)


def load_yaml_text(text: str):
    """Parse one YAML document with the checks above; raises :class:`YamlProblem`."""
    loader = yaml.SafeLoader(text)
    try:
        root = loader.get_single_node()
        if root is None:
            return None
        _check_size(root)
        return loader.construct_document(root)
    except RecursionError:
        raise YamlProblem(f"nested more than {MAX_DEPTH} levels deep; a pipeline file needs a "
                          f"handful") from None
    except yaml.YAMLError as exc:
        raise YamlProblem(f"not valid YAML: {_short_yaml_error(exc)}") from None
    except YamlProblem:
        raise
    except ValueError as exc:  # e.g. an int of more than 4300 digits
        raise YamlProblem(f"not valid YAML: {shorten(str(exc), 200)}") from None
    finally:
        loader.dispose()


def _short_yaml_error(exc: yaml.YAMLError) -> str:
    """PyYAML's message with the quoted source cut down (it can quote a whole line)."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
    context = getattr(exc, "context", None)
    return shorten(f"{where}{problem}" + (f" ({context})" if context else ""), 200)


def read_yaml(data: bytes):
    """Decode a file's bytes as UTF-8 (refusing binary and latin-1 files) and parse them."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise YamlProblem(f"line {line}: byte 0x{data[exc.start]:02x} is not UTF-8 text; save "
                          f"the file as UTF-8 (is it a YAML file?)") from None
    if "\x00" in text:
        raise YamlProblem("holds NUL bytes: a binary file, not YAML text")
    return load_yaml_text(text)
