// Package shape holds no code: its tests keep the core readable by
// measuring it. No function of the core packages grows past
// maxFunctionLines, and tunnelcore.Conn keeps few enough fields that its
// state can be seen at a glance. A test that fails here asks for a split
// into named steps, not for a higher limit.
package shape
