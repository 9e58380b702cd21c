"""EDSelect (``edsd select``, ``cli``): score every target layer on calibration conversations
(``metrics``) and pick the two aux layers."""
