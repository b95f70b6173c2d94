package tunnelpb

import "strconv"

// PortHeldReason is the RejectedRoute reason a node gives a listen-port
// route whose port another agent holds (the smallest agent id owns a
// contested port). The node writes it and sluice-agent check reads it: a
// check advertises under an id of its own beside the running agent of the
// configured id, so the ports that agent holds are refused to the check
// although the configuration is fine.
func PortHeldReason(port uint32, agentID string) string {
	return "port " + strconv.FormatUint(uint64(port), 10) + " is held by agent " + agentID
}
