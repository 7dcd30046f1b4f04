package sockdiag

import "errors"

// ErrNotFound means the client's socket is not in this network namespace's
// tables (a client on another machine, or in another network namespace).
var ErrNotFound = errors.New("client socket not found on this host")
