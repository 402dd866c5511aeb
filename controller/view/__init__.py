"""What a person watching a run sees: the live view (:mod:`.render`, a pure function of
:class:`.model.ViewData`), the figures it is built from (:mod:`.collect`), the terminal it
is drawn on (:mod:`.live`), and the progress of long waits (:mod:`.progress`)."""
