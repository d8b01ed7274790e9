"""What both sides of the process boundary share, and nothing else: the typed messages,
their codec and transport, the launch secret, the config leaves (engine config, sampling
parameters, structured-output specs, speculative config, the logits-processor plugin API,
model sources), the mailbox every actor is built on, and the plumbing of the processes that
speak the protocol (event loop, parent death). The engine core, the front end and gpu/ all
import it; it imports none of them."""
