'use strict';
const isNumber = require('is-number');

/** Sum the numeric entries of a list, ignoring everything else. */
function sumNumbers(values) {
  return values.filter((v) => isNumber(v)).reduce((acc, v) => acc + Number(v), 0);
}

module.exports = { sumNumbers };
