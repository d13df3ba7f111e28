from hetero import docs
from hetero.schema.fields import specs
from hetero.schema.files import KINDS


def test_plan_format_reference_is_up_to_date(repo):
    text = (repo / "docs/plan-format.md").read_text()
    generated = text.split(docs.BEGIN, 1)[1].split(docs.END, 1)[0]
    assert generated == "\n" + docs.reference(), "docs are stale: run `make docs`"


def test_every_field_is_documented():
    todo, seen = list(KINDS.values()), set()
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.add(cls)
        for spec in specs(cls):
            assert spec.doc.strip().endswith("."), f"{cls.__name__}.{spec.name} needs a sentence of documentation"
            inner = docs._schema_of(spec.type)
            if inner:
                todo.append(inner)
