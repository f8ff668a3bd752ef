package pgoutbox

import "github.com/ferrymq/ferry/consumer"

func configErr(field, reason string) error {
	return &consumer.ConfigError{Field: field, Reason: reason}
}
