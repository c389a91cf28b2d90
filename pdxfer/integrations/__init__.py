"""Where inference engines meet pdxfer: each subpackage adapts one engine's own interface
(subclassing the installed engine's classes) and uses only ``pdxfer``'s and ``pdxfer.tiers``'
public names. The only place in pdxfer that imports an engine."""
