"""The fleet simulator behind `spottrain simulate`: an event-driven model of a spot fleet
under the real planner, with the training policies it compares."""
