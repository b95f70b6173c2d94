package tunnelpb

// MaxRouteNameLength is the longest route name, in bytes, that a node
// accepts (README.md §12.3): names are echoed in acks, logs and Connect
// frames. Agents check it when they load their configuration.
const MaxRouteNameLength = 256
