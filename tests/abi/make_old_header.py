#!/usr/bin/env python3
"""An older zeroshard.h: today's header with trailing fields dropped.

    make_old_header.py HEADER OUT STRUCT=FIELD[,FIELD...] ...

Each named field is removed from its struct (it must be among the last ones,
as a later release only appends) and its initialiser from the struct's
ZS_XXX_INIT macro, as if the program had been compiled before those fields
existed. Fails naming a struct or field it cannot find, so the test cannot
silently stop dropping anything when the header changes.
"""
import re
import sys


def split_top_level(body):
    """Initialisers of a { ... } list, split on commas outside nested braces."""
    parts, depth, cur = [], 0, ""
    for ch in body:
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    parts.append(cur.strip())
    return parts


def drop(text, struct, fields):
    m = re.search(r"typedef struct %s \{\n(.*?)\n\} %s;" % (struct, struct), text, re.S)
    if not m:
        sys.exit("make_old_header: struct %s not found" % struct)
    lines = m.group(1).split("\n")
    # Member declarations, last first: the dropped fields must be the tail.
    decls = [i for i, l in enumerate(lines) if re.match(r"\s+[\w ]+\*?\s*\w+(\[\w+\])?;", l)]
    tail = decls[-len(fields):]
    names = [re.search(r"(\w+)(\[\w+\])?;", lines[i]).group(1) for i in tail]
    if names != fields:
        sys.exit("make_old_header: the last fields of %s are %s, not %s" % (struct, names, fields))
    # Comment lines right above a dropped field go with it.
    gone = set(tail)
    for i in tail:
        j = i - 1
        while j >= 0 and lines[j].strip().startswith(("/*", "*")) and j not in decls:
            gone.add(j)
            j -= 1
    body = "\n".join(l for i, l in enumerate(lines) if i not in gone)
    text = text[:m.start(1)] + body + text[m.end(1):]

    macro = "ZS_%s_INIT" % struct[len("zs_"):].upper()
    mm = re.search(r"#define %s\s*\\?\s*\{(.*?)\}[ \t]*\n" % macro, text, re.S)
    if not mm:
        sys.exit("make_old_header: macro %s not found" % macro)
    inits = split_top_level(mm.group(1))
    kept = ", ".join(inits[:len(inits) - len(fields)])
    return text[:mm.start()] + "#define %s { %s }\n" % (macro, kept) + text[mm.end():]


def main(argv):
    header, out, specs = argv[1], argv[2], argv[3:]
    with open(header, encoding="utf-8") as f:
        text = f.read()
    for spec in specs:
        struct, fields = spec.split("=")
        text = drop(text, struct, fields.split(","))
    text = text.replace("#define ZEROSHARD_ZEROSHARD_H\n",
                        "#define ZEROSHARD_ZEROSHARD_H\n#define ZS_TEST_OLD_HEADER 1\n", 1)
    with open(out, "w", encoding="utf-8") as f:
        f.write(text)


if __name__ == "__main__":
    main(sys.argv)
