"""A tiny GRPO run through the whole stack (``make train-demo``): the proof that a
trainer trains through Dynamo, on-policy to the token, its weights pushed back
over the contract every step. ``grpo`` holds the algorithm, ``loop`` the run."""
