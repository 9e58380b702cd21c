"""EDTrain: train EDSD drafters (and an EAGLE-3 baseline with the same data and budget)."""
