"""train.py and the benchmarks add their XLA options without overriding the user's."""

from gdn_jax.training.xla_flags import CPU_FLAGS, add_cpu_flags


def test_flags_are_appended_to_what_the_user_set():
    environ = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    value = add_cpu_flags(environ)
    assert value.split()[0] == "--xla_force_host_platform_device_count=4"
    for name, setting in CPU_FLAGS.items():
        assert f"--{name}={setting}" in value.split()
    assert add_cpu_flags(environ) == value  # idempotent


def test_a_flag_the_user_gave_is_kept():
    name = next(iter(CPU_FLAGS))
    environ = {"XLA_FLAGS": f"--{name}=LIBRARY_FUSION_TYPE_DOT"}
    assert add_cpu_flags(environ) == f"--{name}=LIBRARY_FUSION_TYPE_DOT"
    assert add_cpu_flags({}) == " ".join(f"--{n}={v}" for n, v in CPU_FLAGS.items())
