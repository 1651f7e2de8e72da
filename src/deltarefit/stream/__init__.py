"""Version streams: publishers commit versions bound to their parent, subscribers follow them."""

from .publisher import Publisher, PublishError, publish
from .records import CommitRecord, StreamError, list_versions, load_commit
from .subscriber import Subscriber, SyncReport, sync

__all__ = ["CommitRecord", "PublishError", "Publisher", "StreamError", "Subscriber", "SyncReport", "list_versions",
           "load_commit", "publish", "sync"]
