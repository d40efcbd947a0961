"""Weight sync: publishing the learner's weights to the samplers (distributed broadcast, tensor handles, disk)."""
