"""The workers' side of the cachemgr (the service is ``aegaeon_cachemgr``): typed calls
(``client``), the shared memory they map (``mapped``) and the message forms of shapes and
events (``convert``). Shared worker code: every worker kind and the benches use it; no
service imports another service."""
