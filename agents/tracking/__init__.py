"""Experiment tracking (W&B, Trackio, Weave), optional and off unless a run's ``tracking`` names a tracker."""

from agents.tracking.config import TrackingConfig, TrackioTracking, WandbTracking, WeaveTracking
from agents.tracking.tracker import RunTracker, TrackingError

__all__ = ["RunTracker", "TrackingConfig", "TrackingError", "TrackioTracking", "WandbTracking", "WeaveTracking"]
