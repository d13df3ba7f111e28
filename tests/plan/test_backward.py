"""One rule counts what a plan changes at the process's peak: saved activations and gradients through the step, the
loss's backward first, recomputed blocks rebuilt one at a time, gradients only where they coexist."""

from hetero.plan.backward import UPDATE_PIECE_BYTES, Held, drop_bytes, peak_bytes, update_piece_bytes
from hetero.schema.profile import Layer


def layer(name: str, saved: int, params: int = 0) -> Layer:
    return Layer(name=name, type="Linear", num_params=params // 4, params={"weight": params} if params else {},
                 fp_s=1e-3, bp_s=1e-3, fp_dha_s=None, bp_dha_s=None, bp_grad_host_s=None, saved_bytes=saved,
                 fp_end_s=1e-3, bp_start_s=1e-3)


# two blocks of 100 saved bytes (10 of them their inputs), a head; parameters of 5 bytes a layer
LAYERS = [layer("b.0.x", 60, 5), layer("b.0.y", 40, 5), layer("b.1.x", 60, 5), layer("b.1.y", 40, 5),
          layer("head", 30, 5)]
KEPT = {"b.0": 10, "b.1": 10}


def test_plain_training_peaks_as_backward_starts_or_in_the_step():
    assert peak_bytes(LAYERS) == 230 + 5  # every saved tensor, then the head's gradient beside them
    assert peak_bytes(LAYERS, output_bytes=20) == 230 + 3 * 20  # the loss's backward comes first
    assert peak_bytes([layer("big", 1, 1000)], Held(step=True)) == 1000 + 2 * 1000  # Adam's temporaries


def test_a_recomputed_block_is_rebuilt_on_top_of_what_is_still_held():
    # b.1 rebuilt: b.0's 100, b.1's kept input and the rest of its saving back (90), two layers' gradients
    assert peak_bytes(LAYERS, Held(recomputed={"b.1": 10})) == 100 + 10 + 90 + 10
    # both: the head's 30 and the two inputs as backward starts; b.1 rebuilt beside b.0's input: 10 + 100 + 10
    assert peak_bytes(LAYERS, Held(recomputed=KEPT)) == 120
    # where the loss's backward is the peak, recomputing takes off every block's saving
    assert drop_bytes(LAYERS, KEPT, output_bytes=100) == 2 * 90


def test_gradients_save_only_where_they_coexist_with_the_peak():
    heavy = [layer("a", 10, 100), layer("b", 10, 100)]  # gradients, not activations, make the peak
    assert peak_bytes(heavy) == 10 + 200
    assert peak_bytes(heavy, Held(gone_grads=frozenset({"a", "b"}))) == 20
    assert peak_bytes(heavy, Held(in_backward=True, step=True)) == 10 + 200  # the largest's grad and temporaries
    assert peak_bytes(LAYERS, Held(gone_grads=frozenset({"head"}))) == 230  # backward's start: nothing to save


def test_updates_in_backward_hold_temporaries_of_one_piece_not_of_the_largest_parameter():
    big = 4 * UPDATE_PIECE_BYTES
    heavy = [layer("a", 10, big), layer("b", 10, big)]
    assert peak_bytes(heavy, Held(step=True)) == 2 * big + 2 * big  # every gradient, the largest's temporaries
    assert peak_bytes(heavy, Held(in_backward=True)) == 10 + big + 2 * UPDATE_PIECE_BYTES
    assert update_piece_bytes(None) == UPDATE_PIECE_BYTES
    assert update_piece_bytes(128 << 10) == 120 << 10  # where memory is returned: from the heap, below mmap's
    assert update_piece_bytes(0) == UPDATE_PIECE_BYTES  # every block mapped: no piece small enough, the fewest
