package sockdiag

import "errors"

// ErrNoSocket means the client's socket is not in this network namespace's
// tables (a client on another machine, or in another network namespace).
var ErrNoSocket = errors.New("client socket not found on this host")
