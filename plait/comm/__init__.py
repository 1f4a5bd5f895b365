"""The one door to ``torch.distributed``: meshes, DTensor conversion, collectives.

Planning code never imports this package; the runtime and the launcher do.
"""
