package tunnelpb

// StatusReplaced is the message of the ABORTED status a node ends a session
// with when a newer stream of the same agent id replaced it (README.md §3):
// an agent reads it to tell an id clash from another failure.
const StatusReplaced = "replaced by a newer stream of the same agent id"
