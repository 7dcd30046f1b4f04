//go:build !linux

package origin

import "errors"

var errUnsupported = errors.New("origin checks need Linux procfs")

func (c Checker) socketOwners(map[uint64]struct{}) (map[uint64]owner, error) {
	return nil, errUnsupported
}
func (c Checker) sameMountNamespace(int) (bool, error) { return false, errUnsupported }
