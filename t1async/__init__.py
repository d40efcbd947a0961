"""t1async: asynchronous actor-critic RL for Mixture-of-Experts terminal agents.

The data path is readable top-down from :func:`t1async.service.launch.launch`.
"""

__version__ = "0.1.0"
