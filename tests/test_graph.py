import json

import pytest

from mosaic.graph import GraphError, MMGraph
from tests.helpers import encoders_and_head, spec


def test_levels_put_encoders_before_the_head():
    g = encoders_and_head(3)
    assert g.levels() == [["enc0", "enc1", "enc2"], ["head"]]
    assert g.predecessors("head") == ["enc0", "enc1", "enc2"]
    assert g.independent("enc0", "enc1") and not g.independent("enc0", "head")
    assert g.sinks == ["head"]


def test_json_round_trip_is_lossless():
    g = encoders_and_head(2)
    again = MMGraph.from_json(g.to_json())
    assert again == g


@pytest.mark.parametrize(
    ("modules", "edges", "batch", "needle"),
    [
        ((), (), 8, "no modules"),
        ((spec("a"), spec("a")), (), 8, "duplicate module name 'a'"),
        ((spec("a"), spec("b")), (("a", "c"),), 8, "unknown module 'c'"),
        ((spec("a"), spec("b")), (("a", "b"), ("b", "a")), 8, "cycle"),
        ((spec("a"),), (), 0, "global_batch=0"),
    ],
)
def test_bad_graphs_are_rejected_with_the_field_named(modules, edges, batch, needle):
    with pytest.raises(GraphError, match=needle):
        MMGraph(name="bad", modules=modules, edges=edges, global_batch=batch)


def test_bad_module_fields_are_named():
    with pytest.raises(GraphError, match="kind"):
        spec("x", kind="decoder")
    with pytest.raises(GraphError, match="name"):
        spec("has space")


def test_malformed_graph_json_is_a_graph_error():
    with pytest.raises(GraphError, match="not valid JSON"):
        MMGraph.from_json("{oops")
    with pytest.raises(GraphError, match="expected keys"):
        MMGraph.from_json(json.dumps({"name": "x"}))
