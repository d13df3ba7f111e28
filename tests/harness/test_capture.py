"""Finding the model: the root module whose parameters the first optimizer owns."""

import pytest

from hetero.errors import UNSUPPORTED_SCRIPT, HeteroError
from hetero.profile.profiler import ProfileOptions, measure_script
from tests.profile import scripts

ONE_STEP = ProfileOptions(steps=1, warmup=1)

def test_teacher_and_student_picks_the_one_being_trained(tmp_path):
    path = scripts.write(tmp_path, """
        teacher, student = Net(width=64), Net()
        teacher.requires_grad_(False)
        opt = torch.optim.Adam(student.parameters())
        for _ in range(5):
            x = torch.randn(4, 16)
            loss = F.mse_loss(student(x), teacher(x))
            loss.backward(); opt.step(); opt.zero_grad()
    """)
    run = measure_script(path, [], ONE_STEP)
    assert run.layers[0].params_bytes == (16 * 32 + 32) * 4  # the student's width, not the teacher's
    assert run.training.optimizer == "adam"
    assert run.training.output_bytes == 4 * 4 * 4  # what the student returns, the loss's backward starts from


def test_a_model_called_only_inside_the_closure_step_runs_is_found_and_its_step_timed_after_it(tmp_path):
    path = scripts.write(tmp_path, """
        import time
        model = Net()
        opt = torch.optim.AdamW(model.parameters())
        def closure():
            opt.zero_grad()
            loss = F.mse_loss(model(torch.randn(4, 16)), torch.randn(4, 4))
            loss.backward()
            time.sleep(0.3)  # a step span that began before the closure ended would hold this
            return loss
        for _ in range(5):
            opt.step(closure)
    """)
    run = measure_script(path, [], ONE_STEP)
    assert run.training.optimizer == "adamw" and all(layer.fp_s > 0 for layer in run.layers)
    assert run.training.optimizer_step_s < 0.3  # Adam on 1,796 parameters alone


def test_an_optimizer_of_no_module_called_by_its_step_is_refused_as_unsupported(tmp_path):
    path = scripts.write(tmp_path, """
        model = Net()
        opt = torch.optim.AdamW(model.parameters())
        for _ in range(3):
            opt.step()
    """)
    with pytest.raises(HeteroError) as e:
        measure_script(path, [], ONE_STEP)
    assert e.value.exit_code == UNSUPPORTED_SCRIPT


TWO_MODELS = """
    encoder, decoder = Net(), nn.Linear(4, 16)
    opt = torch.optim.AdamW(list(encoder.parameters()) + list(decoder.parameters()))
    for _ in range(5):
        x = torch.randn(4, 16)
        F.mse_loss(decoder(encoder(x)), x).backward(); opt.step(); opt.zero_grad()
"""


def test_several_candidates_are_listed_by_their_names(tmp_path):
    path = scripts.write(tmp_path, TWO_MODELS)
    with pytest.raises(HeteroError) as e:
        measure_script(path, [], ONE_STEP)
    assert e.value.message == "several models own parameters of the optimizer: encoder (Net), decoder (Linear)"
    assert e.value.hint == "choose one with --model NAME, e.g. --model encoder"


def test_model_option_chooses_among_candidates(tmp_path):
    path = scripts.write(tmp_path, TWO_MODELS)
    run = measure_script(path, [], ProfileOptions(steps=1, warmup=1, model_name="decoder"))
    assert [layer.name for layer in run.layers] == ["(model)"]


def test_wrapped_models_are_unwrapped(tmp_path):
    path = scripts.write(tmp_path, """
        import socket
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        try:
            model = DDP(Net())
            opt = torch.optim.AdamW(model.parameters())
            for _ in range(5):
                F.cross_entropy(model(torch.randn(4, 16)), torch.randint(4, (4,))).backward()
                opt.step(); opt.zero_grad()
        finally:
            dist.destroy_process_group()
    """)
    run = measure_script(path, [], ONE_STEP)
    assert [layer.name for layer in run.layers] == ["body.0", "body.2", "norm", "head"]


def test_scripts_catching_exception_cannot_swallow_the_stop(tmp_path):
    path = scripts.write(tmp_path, """
        model = Net(); opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(100):
            try:
                F.cross_entropy(model(torch.randn(4, 16)), torch.randint(4, (4,))).backward(); opt.step()
            except Exception:
                pass
        raise SystemExit("ran to the end: the stop was swallowed")
    """)
    run = measure_script(path, [], ProfileOptions(steps=2, warmup=1))
    assert run.training.optimizer == "other" and run.training.steps_measured == 2


def test_a_script_ending_early_says_how_many_steps_it_saw(tmp_path):
    path = scripts.write(tmp_path, scripts.LOOP)
    with pytest.raises(HeteroError) as e:
        measure_script(path, ["--steps", "3"], ProfileOptions(steps=5, warmup=2))
    assert e.value.message == ("the script ended after 3 optimizer steps; hetero profile needs 7 "
                               "(--warmup 2 + --steps 5)")


def test_warmup_of_zero_is_refused(tmp_path):
    with pytest.raises(HeteroError, match="need at least 1 warm-up step"):
        measure_script(scripts.write(tmp_path, scripts.LOOP), [], ProfileOptions(steps=1, warmup=0))


@pytest.mark.parametrize("flags, implementation", [("", "single"), ("foreach=True", "foreach"),
                                                   ("fused=True", "fused")])
def test_how_torch_steps_the_scripts_adam_is_recorded(tmp_path, flags, implementation):
    path = scripts.write(tmp_path, scripts.LOOP.replace("lr=1e-3)", f"lr=1e-3, {flags})" if flags else "lr=1e-3)"))
    run = measure_script(path, ["--steps", "4"], ONE_STEP)
    assert [o.implementation for o in run.training.optimizers] == [implementation]  # on a CPU: single by default
