"""One reconciler per kind: Model, DraftPairing, SpecPolicy, Topology and, on a head, Node.
``control/plane.py`` wires them to the manager and says which change looks at what."""
