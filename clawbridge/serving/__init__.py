"""What answers a request: the Sampler seam (token ids in, token ids and logprobs out) and the router that picks the policy version."""
