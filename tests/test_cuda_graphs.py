from runtime.worker.paths.cuda.cuda_graphs import (
    GRAPHS_VAR,
    LIFTED_SIZE_LIMIT,
    SIZE_LIMIT_VAR,
    launch_directly,
    lift_graph_size_limit,
)


def test_the_graph_size_limit_is_lifted_on_cuda_only_and_never_over_the_users_choice():
    env: dict[str, str] = {}
    assert not lift_graph_size_limit(env, cuda=False) and env == {}
    assert lift_graph_size_limit(env, cuda=True) and env == {SIZE_LIMIT_VAR: str(LIFTED_SIZE_LIMIT)}
    chosen = {SIZE_LIMIT_VAR: "200"}
    assert not lift_graph_size_limit(chosen, cuda=True) and chosen == {SIZE_LIMIT_VAR: "200"}


def test_cuda_graphs_are_turned_off_on_cuda_only_and_never_over_the_users_choice():
    env: dict[str, str] = {}
    assert not launch_directly(env, cuda=False) and env == {}
    assert launch_directly(env, cuda=True) and env == {GRAPHS_VAR: "0"}
    chosen = {GRAPHS_VAR: "1"}
    assert not launch_directly(chosen, cuda=True) and chosen == {GRAPHS_VAR: "1"}
