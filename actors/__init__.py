"""Ray actor roles (plain classes; ``ray.remote`` is applied in :mod:`t1async.launch`)."""
