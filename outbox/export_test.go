package outbox

// CrashAfterPublish makes r call f after each confirmed publish and before
// the delete; when f returns true, Run stops right there without deleting or
// giving back its lanes, as if the process had died.
func CrashAfterPublish(r *Relay, f func() bool) { r.crashAfterPublish = f }
