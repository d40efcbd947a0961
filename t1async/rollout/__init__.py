"""One episode: the loop from task to trajectory, the Env protocol, admission rules, actions, the OpenAI endpoint."""
