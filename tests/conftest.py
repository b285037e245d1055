import os

from hypothesis import HealthCheck, settings

# CI runs every property 200 times; locally a quicker profile. Deadlines are off: a first call
# into torch can take far longer than the following ones.
settings.register_profile(
    "ci",
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
settings.register_profile("dev", max_examples=30, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))
